from plugins_app.channel.workers.weixin import main

main()
