from django import forms


class OrderForm(forms.Form):
    """What ``POST /orders/`` accepts, as a JSON object."""

    customer = forms.EmailField()
    sku = forms.RegexField(
        regex=r"^[A-Za-z0-9_-]{1,64}$", error_messages={"invalid": "Use 1 to 64 of A-Z a-z 0-9 _ -."}
    )
    quantity = forms.IntegerField(min_value=1, max_value=10_000)
    unit_price = forms.DecimalField(min_value=0, max_digits=10, decimal_places=2)
