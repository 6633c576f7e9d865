"""Adapters that route other libraries' GDN entry points to flashqla (see :mod:`flashqla.integrations.fla`)."""
