"""Model families behind the seam of :mod:`atp_pipeline.models.adapter`; model code
knows nothing of parallelism, which is applied from outside (:mod:`atp_pipeline.parallel`)."""
