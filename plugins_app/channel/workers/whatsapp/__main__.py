"""``python -m plugins_app.channel.workers.whatsapp``: the worker the supervisor starts."""
from .worker import main

main()
