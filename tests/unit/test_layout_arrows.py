"""The stages split out of transport.py and consumer.py point one way along
the data's path: a stage never imports the module that carries its methods
(transport, consumer) at run time, so there is no import circle, and the
tenant ``set_config`` call is spelled in one module only (issue 15: "the
tenant SQL once")."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "django_platformkit"

STAGES = {
    "transport": ["streams", "publishing", "pulling", "acks"],
    "consumer": ["claim", "handler", "settling", "units"],
}


def runtime_imports(module: str) -> set[str]:
    """The package modules ``module`` imports when it runs: every relative
    import except those under ``if TYPE_CHECKING:``."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and ast.unparse(child.test) == "TYPE_CHECKING":
                for orelse in child.orelse:
                    visit(orelse)
                continue
            if isinstance(child, ast.ImportFrom) and child.level == 1:
                if child.module:
                    found.add(child.module.split(".")[0])
                else:
                    found.update(alias.name for alias in child.names)
            visit(child)

    visit(tree)
    return found


@pytest.mark.parametrize(
    ("home", "stage"), [(h, s) for h, stages in STAGES.items() for s in stages], ids=lambda v: str(v)
)
def test_a_stage_never_imports_the_module_that_carries_it(home, stage):
    imports = runtime_imports(stage)
    assert home not in imports, f"{stage}.py imports {home} at run time: an import circle"
    # Nor the other stages of its own module's split, except the shared values (units).
    siblings = set(STAGES[home]) - {stage, "units"}
    assert not (imports & siblings), f"{stage}.py imports {sorted(imports & siblings)}: stages stay side by side"


def test_the_consumer_side_never_imports_the_transport_at_run_time():
    # The worker hands the consumer its transport: handling events imports no nats.
    for module in ["consumer", *STAGES["consumer"]]:
        imports = runtime_imports(module)
        assert not (imports & {"transport", *STAGES["transport"]}), module


def test_the_tenant_set_config_is_spelled_in_one_module():
    spelled = sorted(
        path.name for path in PACKAGE.rglob("*.py") if "set_config('platformkit.tenant'" in path.read_text()
    )
    assert spelled == ["subscriptions.py"]


def test_the_claim_statement_sets_the_tenant_with_the_shared_call():
    from django_platformkit.consume.claim import _claim_sql
    from django_platformkit.consume.tenancy import TENANT_SET_CONFIG

    for trusted in (True, False):
        assert f"{TENANT_SET_CONFIG} AS n" in _claim_sql(trusted)


def test_transport_and_consumer_still_carry_every_method_of_their_stages():
    from django_platformkit.broker.acks import _Acks
    from django_platformkit.broker.publishing import _Publishing
    from django_platformkit.broker.streams import _Streams
    from django_platformkit.broker.transport import Transport
    from django_platformkit.consume.claim import _Claiming
    from django_platformkit.consume.consumer import Consumer
    from django_platformkit.consume.handler import _Running
    from django_platformkit.consume.settle import _Settling

    for owner, parts in ((Transport, (_Streams, _Publishing, _Acks)), (Consumer, (_Claiming, _Running, _Settling))):
        for part in parts:
            methods = [n for n, v in vars(part).items() if callable(v) and not n.startswith("__")]
            assert methods, part
            for name in methods:
                assert getattr(owner, name) is getattr(part, name), f"{owner.__name__}.{name}"
