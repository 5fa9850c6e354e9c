from django.contrib import admin

from .models import Confirmation, Order, OrderStats


@admin.register(Order)
class OrderAdmin(admin.ModelAdmin):
    list_display = ["id", "customer", "sku", "quantity", "total", "created_at"]
    search_fields = ["customer", "sku"]
    date_hierarchy = "created_at"


@admin.register(Confirmation)
class ConfirmationAdmin(admin.ModelAdmin):
    list_display = ["id", "order", "event_id", "created_at"]
    search_fields = ["event_id"]
    readonly_fields = ["order", "event_id", "message", "created_at"]


@admin.register(OrderStats)
class OrderStatsAdmin(admin.ModelAdmin):
    list_display = ["name", "orders", "items", "revenue", "updated_at"]
    readonly_fields = ["orders", "items", "revenue", "updated_at"]
