from paged_chat.cli.main import main

main()
