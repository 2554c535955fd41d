"""Planning a step before running it: the encoder cost model (:mod:`.costs`), a batch's vision loads
(:mod:`.loads`), the step-time models (:mod:`.simulate` for GPipe / 1F1B, :mod:`.stepmodel` for any torch
schedule with the vision work placed on stage 0 or spread), their replay in time (:mod:`.replay`) and
timelines drawn as SVG (:mod:`.timeline`). :mod:`.costs` and :mod:`.timeline` are leaves that the producer
and the pipeline use too; nothing here is imported when this package is.
"""
