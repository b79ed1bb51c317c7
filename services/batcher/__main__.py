from services.batcher.service import main

main()
