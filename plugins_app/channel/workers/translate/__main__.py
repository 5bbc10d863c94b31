from plugins_app.channel.workers.translate import main

main()
