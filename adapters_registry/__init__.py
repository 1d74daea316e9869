"""The catalog of LoRA adapters: where their weights live, which versions exist, which serve.

The server opens it with `lifecycle.open_adapter_source(...)` in its lifespan and gets a
`admin.ManagedRegistry`: the `base.AdapterSource` the gateway leases adapters from, plus the
operations behind /admin/v1/adapters. The engine side is the `engine.EngineLoraControl` Protocol.
"""
