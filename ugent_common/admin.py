"""What every room's admin shares: records shown, never edited, and buttons that post to an action."""
from __future__ import annotations

from django.contrib import admin


class RecordAdmin(admin.ModelAdmin):
    """A record (a turn, a receipt, a message, an event): readable in the admin, never added, edited or
    deleted there. What an operator may do to one is an action that calls a service."""

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    def may_act(self, request) -> bool:
        """An operator action needs the model's change permission, which the record itself never grants."""
        opts = self.model._meta
        return request.user.has_perm(f"{opts.app_label}.change_{opts.model_name}")
