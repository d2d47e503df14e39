from datacat.cli import main

main()
