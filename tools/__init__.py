"""The tools around the mesh, used by people, not by services: the `infermesh`
command (cli.py), `infermesh up` / `trace` (launch/), the seeded checkpoint
writer behind `infermesh make-model` (make_model.py) and the benchmarks
(bench/). They sit above everything else: tools import services and shared,
nothing imports tools."""
