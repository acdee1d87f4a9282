from services.decode.service import setup
from shared.runtime.service import main

main("decode", setup)
