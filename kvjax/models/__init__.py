"""Model code: layers, attention (MHA/GQA/MQA, window), MLA, the decoder LM, weight conversions."""
