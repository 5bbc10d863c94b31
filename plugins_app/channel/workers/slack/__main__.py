from plugins_app.channel.workers.slack import main

main()
