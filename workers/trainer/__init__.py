"""The bundled hybrid-parallel trainer (torch only, no Django).

This package's __init__ stays free of torch so the control plane can import
`workers.trainer.presets` to validate layouts without torch installed.
"""
