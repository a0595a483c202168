from django.urls import path
from rest_framework.routers import SimpleRouter

from apps.costs.api import views

router = SimpleRouter()
router.register("owned-prices", views.OwnedPriceViewSet, basename="owned-price")
router.register("cloud-prices", views.CloudPriceViewSet, basename="cloud-price")
router.register("pool-discounts", views.PoolDiscountViewSet, basename="pool-discount")
router.register("spot-prices", views.SpotPriceViewSet, basename="spot-price")
router.register("usage", views.UsageEntryViewSet, basename="usage")
router.register("budgets", views.BudgetViewSet, basename="budget")
router.register("budget-alerts", views.BudgetAlertViewSet, basename="budget-alert")

urlpatterns = [
    path("spend/", views.SpendView.as_view(), name="spend"),
    path("spend/daily/", views.DailySpendView.as_view(), name="spend-daily"),
    path("spend/top-jobs/", views.TopJobsView.as_view(), name="spend-top-jobs"),
    *router.urls,
]
