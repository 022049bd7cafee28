/**
 * The shapes the client reads and writes (PROTOCOL §2.2, §4, §5, §2.3).
 * Files are other programs' words: every field is optional unless the
 * client checked it, and unknown fields are kept.
 */
export {};
