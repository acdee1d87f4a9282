from services.prefill.service import setup
from shared.runtime.service import main

main("prefill", setup)
