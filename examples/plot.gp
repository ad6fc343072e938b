# Loss and test accuracy per epoch of examples/train.lua (gnuplot, Debian's gnuplot-nox).
#
#   gnuplot -e "data='checkpoints/metrics.tsv'; out='checkpoints/metrics.png'; npre=4; ntest=10000" examples/plot.gp
#
# data: two blocks separated by two blank lines (gnuplot's "index"): 0 = pretraining, 1 = linear
# evaluation; columns: x (epochs on one time line: linear-eval epoch k is at npre + k), epoch within
# its phase, mean training loss, test accuracy. train.lua writes it from the JSONL metrics.
if (!exists("data")) data = 'checkpoints/metrics.tsv'
if (!exists("out")) out = 'checkpoints/metrics.png'
if (!exists("npre")) npre = 0
if (!exists("ntest")) ntest = 10000
if (!exists("nlin")) nlin = 0

set terminal pngcairo size 1200,480 font "DejaVu Sans,11" noenhanced
set output out
set datafile missing "NaN"
plural(n) = n == 1 ? "" : "s"
set multiplot layout 1,2 title sprintf("Fashion-MNIST with FSDP: %d pretraining epoch%s, then %d linear-evaluation epoch%s on the frozen trunk", npre, plural(npre), nlin, plural(nlin)) font ",13"

set style line 1 lc rgb "#1f77b4" lw 2.5 pt 7 ps 1.3
set style line 2 lc rgb "#d62728" lw 2.5 pt 5 ps 1.3
set grid lc rgb "#e0e0e0"
set border lc rgb "#555555"
set xlabel "epoch (pretraining, then linear evaluation)"
set xtics 1
set xrange [0.5:npre + nlin + 0.5]
# linear-eval epochs are labelled "lin 1", "lin 2", ... after the pretraining epochs
if (npre > 0) set xtics (1)
if (npre > 1) do for [k=2:npre] { set xtics add (sprintf("%d", k) k) }
if (nlin > 0) do for [k=1:nlin] { set xtics add (sprintf("lin %d", k) npre + k) }
set offsets 0, 0, graph 0.05, graph 0.05
set key outside bottom center horizontal
set bmargin 6
# where the linear evaluation starts (it trains a new head: its first loss is high again)
if (nlin > 0) set arrow 1 from npre + 0.5, graph 0 to npre + 0.5, graph 1 nohead dt 3 lc rgb "#888888"
if (nlin > 0) set label 1 "linear eval" at npre + 0.5 + nlin / 2.0, graph 0.95 center tc rgb "#888888"

set title "training loss (mean cross entropy of the epoch)"
set ylabel "loss"
set yrange [0:*]
plot data index 0 using 1:3 with linespoints ls 1 title "pretraining", \
     data index 1 using 1:3 with linespoints ls 2 title "linear eval (new head, frozen trunk)"

set title sprintf("test accuracy (%d test images)", ntest)
set ylabel "accuracy"
set yrange [*:*]
set format y "%.2f"
plot data index 0 using 1:4 with linespoints ls 1 title "pretraining", \
     data index 1 using 1:4 with linespoints ls 2 title "linear eval", \
     0.89 with lines dt 2 lw 1.5 lc rgb "#1f77b4" title "target 0.89", \
     0.85 with lines dt 2 lw 1.5 lc rgb "#d62728" title "target 0.85"

unset multiplot
