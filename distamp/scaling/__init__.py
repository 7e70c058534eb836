"""Loss scaling: the scalers (static, backoff with Paddle's counters, log-normal) and overflow attribution.

``scaler_base.LossScaler`` is what the precision plugins hold (``scale``,
``update(found_inf, grad_max)``, ``state_dict``); ``loss_scaler.build_loss_scaler``
picks one from ``amp_configs``; ``overflow`` names the parameters whose
gradient is non-finite on a skipped step. Scaling sits below the core: every
precision plugin, sharded or not, scales its loss with one of these.
"""
