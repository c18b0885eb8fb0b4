"""The node cache server: one host pool and one local disk for every engine on a machine
(``kvtier serve node``; engines reach it as the ``node://`` tier, ``kvtier.tiers.node``)."""
