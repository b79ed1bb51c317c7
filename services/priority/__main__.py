from services.priority.service import main

main()
