"""``python -m plugins_app.channel.workers.telegram``: the worker the supervisor starts."""
from .worker import main

main()
