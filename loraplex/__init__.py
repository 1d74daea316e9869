"""loraplex: serve fleets of LoRA adapters of one base model behind one OpenAI-compatible endpoint.

The packages live at the repository's top level (server/, adapters_registry/, kernels/); the links
in this folder make them importable as loraplex.server, loraplex.adapters_registry, loraplex.kernels.
"""
