# Makes conf/ importable as hyperpar.conf so Hydra finds it with pkg://hyperpar.conf.
