# Train a randomly initialised model on the source dataset (the offline
# stand-in for a model-zoo checkpoint); every parameter is trained. The
# model bases set backbone.norm_eval=True for finetuning: a from-scratch
# run needs norm_eval=False (tools/run_protocol.py sets it).
_base_ = ['../schedules/pretrain_source_8k.py']
