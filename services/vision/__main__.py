from services.vision.service import setup
from shared.runtime.service import main

main("vision", setup)
