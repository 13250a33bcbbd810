"""The parallelism pieces: the mesh of named axes (``mesh``), the rule tables that map
logical axis names onto them (``rules``), the collectives read back from compiled
programs (``collectives``), the processes of a multi-host run (``distributed``), the
platform the devices are (``platforms``) and Accelerate's names for the mesh
(``parallelism``: ``ParallelismConfig``)."""
