"""The shared machinery every analysis is built on; not a public API.

Configs and statuses (:mod:`.config`, :mod:`.status`, :mod:`.retry`), particles and their
checks (:mod:`.particles`, :mod:`.frontend`), the periodic geometry (:mod:`.geometry`,
:mod:`.ghosts`), the 2D mesh's pencils (:mod:`.layout`), cell sorting (:mod:`.cells`), the
domain decomposition (:mod:`.domain`), the sharded programs (:mod:`.pipeline`) and the
catalogue (:mod:`.catalogue`). Nothing here imports an analysis.
"""
