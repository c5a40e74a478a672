"""Moves regions of registered buffers between ranks: rank table, fabrics, plans, collectives.

Entry points: `transfer.fabric.create_fabric`, `transfer.collectives` (send_regions, recv_regions,
chain_broadcast, tanz_broadcast, ring_allgather), `transfer.errors`. See README.md.
"""
