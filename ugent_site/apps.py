from django.apps import AppConfig


class UgentSiteConfig(AppConfig):
    name = "ugent_site"
    verbose_name = "UGENT"

    def ready(self):
        from django.conf import settings

        from ugent_common.malloctrim import limit_arenas
        # as every process starts (rundaemon, a web process, a worker, the supervisor), before its threads do
        limit_arenas(settings.UGENT_MALLOC_ARENA_MAX)

    def background_services(self, mode):
        """rundaemon's metrics listener, when UGENT_METRICS_BIND names one (ugent_site/metrics.py)."""
        from ugent_site.metrics import background_services
        return background_services(mode)
