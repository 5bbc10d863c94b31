from plugins_app.channel.workers.salesforce import main

main()
