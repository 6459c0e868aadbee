"""The paged KV core, in layers that import only downward:

``layout`` (pure arithmetic) -> ``allocator`` (free list) -> ``pool`` (tensors)
-> ``attention`` (per-layer contexts) -> ``state`` (per-session KV) -> ``cache``
(the worker's KV, factory of states). Import the submodules directly; this
package stays empty so that ``layout`` can be used without importing torch.
"""
