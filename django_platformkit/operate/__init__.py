"""4. Operator verbs over stored rows: replay and discard a dead letter,
republish what the broker lost, purge what no longer guards anything. Each
refuses to lose evidence, and the audit ones say who acted and why."""
