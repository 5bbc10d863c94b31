from plugins_app.channel.workers.wecom import main

main()
