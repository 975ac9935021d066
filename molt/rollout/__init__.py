"""The generator: vLLM engine actors, router, streaming pool, weight refit (see each module).

Import the submodules directly (`molt.rollout.engine`, `.router`, `.pool`, `.sampling`, `.routes`);
this package imports nothing, so importing it does not pull in vLLM or Ray.
"""
