"""The live ATP in-network aggregation backend: real processes exchanging ATP packets over UDP.

=====================  ========================================================================
module                 what it holds
=====================  ========================================================================
:mod:`.rpc`            the roles' control channel (job setup/teardown §5.1, stats, shutdown):
                       its messages, their schema and access rules, server and client
:mod:`.wire`           the control channel's framing: length-prefixed JSON objects, size-capped
:mod:`.auth`           the control channel's secret (per run, or a 0600 file) and HMAC handshake
:mod:`.tenancy`        which job belongs to which tenant (token) of a shared role; the owner token
:mod:`.role`           what every role process has: UDP socket, control server, data-plane loop
:mod:`.nodes`          the switch emulator and parameter-server processes (UDP data plane)
:mod:`.bmv2_node`      the switch role on BMv2: the compiled P4 program as its data plane
:mod:`.engine`         the worker end-host stack in a training rank (thread, Future API)
:mod:`.services`       starting/connecting/stopping roles, installing and removing jobs
:mod:`.sync`           one data-parallel group's ATP job; the DDP communication hook
=====================  ========================================================================

Nothing here imports torch at module import except :mod:`.engine` and :mod:`.sync`; the
role processes run with numpy only.
"""
