"""The admin site of the control room: Django's admin with the health board as its index."""
from django.contrib import admin
from django.contrib.admin.apps import AdminConfig


class ControlRoom(admin.AdminSite):
    site_header = "UGENT control room"
    site_title = "UGENT"
    index_title = "Health and records"
    index_template = "admin/ugent_index.html"

    def index(self, request, extra_context=None):
        from ugent_site.board import health_board
        context = {"board": health_board(), **(extra_context or {})}
        return super().index(request, extra_context=context)


class ControlRoomAdminConfig(AdminConfig):
    default_site = "ugent_site.admin_site.ControlRoom"
