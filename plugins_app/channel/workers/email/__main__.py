"""python -m plugins_app.channel.workers.email [args]: the email channel's worker process."""
from .worker import main

main()
