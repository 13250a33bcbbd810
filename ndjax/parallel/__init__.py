"""The parallelism pieces: the mesh of named axes (``mesh``), the rule tables that map
logical axis names onto them (``rules``), the collectives read back from compiled
programs (``collectives``) and the processes of a multi-host run (``distributed``)."""
