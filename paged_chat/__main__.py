from paged_chat.cli import main

main()
