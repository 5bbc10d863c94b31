from plugins_app.channel.workers.dingtalk import main

main()
