from services.admission.service import main

main()
