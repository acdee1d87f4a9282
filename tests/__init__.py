"""InferMesh's tests, in tiers by what they start: unit/ (in this process, exact),
parity/ (numerics against transformers and references, Triton kernels under the
interpreter), mesh/ (real nats-server, service processes and meshes), deploy/
(compose, Helm, the Dockerfile, `infermesh up`'s errors) and gpu/ (run on the device
machine); helpers/ holds what they share, the conftest.py files their fixtures."""
