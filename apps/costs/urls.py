from django.urls import path

from apps.costs import views

app_name = "costs"
urlpatterns = [
    path("", views.overview, name="overview"),
    path("figures/", views.figures, name="figures"),
    path("spend.csv", views.spend_csv, name="spend-csv"),
    path("spend-by-day.csv", views.daily_csv, name="daily-csv"),
    path("top-jobs.csv", views.top_jobs_csv, name="top-jobs-csv"),
    path("budgets.csv", views.budgets_csv, name="budgets-csv"),
    path("usage.csv", views.usage_csv, name="usage-csv"),
    path("prices.csv", views.prices_csv, name="prices-csv"),
    path("budgets/", views.budget_set, name="budget-set"),
    path("prices/<str:kind>/", views.price_add, name="price-add"),
]
