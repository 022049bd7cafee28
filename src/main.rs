fn main() {
    std::process::exit(runspool::cli::main());
}
