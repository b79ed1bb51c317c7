from services.executor.service import main

main()
