"""The generator: vLLM engine actors, dispatcher, streaming pool, weight refit (see each module).

Import the submodules directly (`molt.rollout.engine`, `.dispatch`, `.pool`, `.sampling`, `.routes`);
this package imports nothing, so importing it does not pull in vLLM or Ray.
"""
