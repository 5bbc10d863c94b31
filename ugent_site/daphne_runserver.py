"""daphne's place in INSTALLED_APPS, in a module of its own: ugent_site.apps keeps one AppConfig, the one
Django picks for "ugent_site"."""
from django.apps import AppConfig


class DaphneRunserverConfig(AppConfig):
    """daphne in INSTALLED_APPS for its `runserver` (manage.py runserver serves through daphne), without the
    Twisted server every process imported at django.setup: daphne's own AppConfig imports daphne.server
    (about 150 ms of a process's start) to install its reactor early. Here the reactor is installed when
    runserver's command module imports daphne.server, before anything else asks for one (nothing else in
    the project imports Twisted). Listed before django.contrib.staticfiles, so its runserver is the one."""
    name = "daphne"
    label = "daphne"
    verbose_name = "Daphne"
