from services.balancer.service import setup
from shared.runtime.service import main

main("balancer", setup, grpc_server=False)
