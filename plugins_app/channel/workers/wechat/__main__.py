"""``python -m plugins_app.channel.workers.wechat``: the worker the supervisor starts."""
from .worker import main

main()
