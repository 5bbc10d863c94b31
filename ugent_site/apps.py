from django.apps import AppConfig


class UgentSiteConfig(AppConfig):
    name = "ugent_site"
    verbose_name = "UGENT"

    def background_services(self, mode):
        """rundaemon's metrics listener, when UGENT_METRICS_BIND names one (ugent_site/metrics.py)."""
        from ugent_site.metrics import background_services
        return background_services(mode)
