"""The Costs page's forms: a team's budget, and rows of the price book (finance)."""

from django import forms

from apps.costs.models import CloudPrice, OwnedPrice, PoolDiscount
from apps.fleet.models import PoolKind
from apps.fleet.selectors import pools_of_kind


class BudgetForm(forms.Form):
    team = forms.ModelChoiceField(queryset=None)
    monthly_limit = forms.DecimalField(max_digits=14, decimal_places=2, min_value=0)
    stop_submissions = forms.BooleanField(
        required=False, label="At 100%, refuse new jobs as well (bursting stops anyway)"
    )
    notify_emails = forms.CharField(required=False, max_length=1000, label="Also alert (emails)")
    webhook_url = forms.URLField(
        required=False, max_length=1000, label="Webhook (https)", assume_scheme="https"
    )

    def __init__(self, *args, teams, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["team"].queryset = teams


class OwnedPriceForm(forms.ModelForm):
    class Meta:
        model = OwnedPrice
        fields = [
            "pool",
            "effective_from",
            "purchase_price",
            "depreciation_months",
            "electricity_per_kwh",
            "pue",
            "overhead_per_month",
            "default_power_w",
            "source",
        ]
        labels = {
            "electricity_per_kwh": "Electricity per kWh",
            "pue": "PUE",
            "default_power_w": "Default power (W)",
        }

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["pool"].queryset = pools_of_kind(PoolKind.OWNED)


class CloudPriceForm(forms.ModelForm):
    class Meta:
        model = CloudPrice
        fields = ["instance_type", "region", "effective_from", "per_hour", "source"]


class PoolDiscountForm(forms.ModelForm):
    class Meta:
        model = PoolDiscount
        fields = ["pool", "effective_from", "percent", "source"]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["pool"].queryset = pools_of_kind(PoolKind.CLOUD)
