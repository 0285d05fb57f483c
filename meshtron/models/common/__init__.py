"""Pieces several models share: layout checks now, the MoE block later."""
