from plugins_app.channel.workers.line import main

main()
